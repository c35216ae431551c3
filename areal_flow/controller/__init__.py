"""The controller: policy version, staleness admission, the sample buffer, firing batch nodes."""
