"""The weight version of each generated token, from what each kind of server reports."""

from areal_flow.generation.client.versions import token_versions


def test_areal_flow_servers_tag_every_token():
    assert token_versions({"output_token_versions": [3, 3, 4], "weight_version": "4"}, 3) == [3, 3, 4]


def test_sglang_spans_tag_the_tokens_of_a_retracted_answer():
    meta = {"weight_version": "5", "weight_versions": [{"version": "4", "start": 0, "end": 2},
                                                         {"version": "5", "start": 2, "end": 5}]}
    assert token_versions(meta, 5) == [4, 4, 5, 5, 5]


def test_older_sglang_tags_every_token_with_the_answer_version_and_default_counts_as_zero():
    assert token_versions({"weight_version": "7"}, 2) == [7, 7]
    assert token_versions({"weight_version": "default"}, 3) == [0, 0, 0]
    assert token_versions({}, 1) == [0]
