"""An agent's text mapped back onto its tokens (agents/text_map.py)."""

from areal_flow.agents.text_map import TextMap

VOCAB = {"a": 1, "b": 2, "c": 3, "<s>": 9, "ab": 12, "</p>": 7, "x": 4, "y": 5}


def encode(text: str) -> list[int]:
    """A toy tokenizer that merges "ab" (so text tokenized again can split otherwise) and knows two
    special strings."""
    out, i = [], 0
    while i < len(text):
        for piece in ("</p>", "<s>", "ab", text[i]):
            if text.startswith(piece, i):
                out.append(VOCAB[piece])
                i += len(piece)
                break
    return out


def test_a_prompt_that_starts_with_what_the_rollout_sent_and_got_keeps_those_tokens():
    texts = TextMap()
    assert texts.tokens("ab", encode) == [12]  # nothing known: tokenized whole
    # The answer: a, <s> (a special token its text left out), b, then the stop string </p>.
    texts.learn("ab", [12], [("ab", "a<s>b</p>", [1, 9, 2, 7])])
    # The agent sends back the text it got without the stop string, then adds its own: the policy's
    # tokens stay as they were (not "ab" merged, not without <s> or </p>), and only "xy" is new.
    assert texts.tokens("ab" + "ab" + "xy", encode) == [12, 1, 9, 2, 7, 4, 5]
    # With the stop string written back: the longer known text (what the tokens decode to) wins.
    assert texts.tokens("ab" + "a<s>b</p>" + "c", encode) == [12, 1, 9, 2, 7, 3]
    # A history that is neither (edited): tokenized as it is, and the recorder will count a drift.
    assert texts.tokens("abba", encode) == [12, 2, 1]
    # The next call extends the first one's text: its own prompt is known too.
    texts.learn("abab" + "xy", [12, 1, 9, 2, 7, 4, 5], [("c", "c", [3])])
    assert texts.tokens("ababxycx", encode) == [12, 1, 9, 2, 7, 4, 5, 3, 4]


def test_an_empty_answer_s_token_is_kept_and_a_prompt_asked_again_is_its_own_tokens():
    texts = TextMap()
    texts.learn("ab", [12], [("", "<s>", [9])])  # an answer of one special token: its text is empty
    assert texts.tokens("ab", encode) == [12]  # the same prompt again: another sample of the turn
    assert texts.tokens("abxy", encode) == [12, 9, 4, 5]  # the agent went on: after the policy's token
