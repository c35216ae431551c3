"""How samples and control messages travel between processes: msgspec Structs over ZeroMQ."""
