"""tiny_arith_tool's model: a tokenizer that writes the tool's tags as one token each, reference
traces that use the tool some of the time, and a bootstrap that never trains on the tool's answer."""

from areal_flow.data.arith import prompt_text
from areal_flow.models.supervised import supervised_batch
from areal_flow.models.tasks import TOOL_SHARE, TOOL_WORDS, arith_tool_pairs, bootstrap_task, tool_completion
from areal_flow.models.tokenizer import CODE_CHARS, build_char_tokenizer

TOK = build_char_tokenizer(CODE_CHARS, words=TOOL_WORDS)

def test_the_tags_are_one_token_each_and_read_back_whatever_the_decode_skips():
    text = "<python>print(1+2)</python>\n<output>\n3\n</output>\n#### 3"
    ids = TOK.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) - sum(len(w) - 1 for w in TOOL_WORDS)  # each tag one token, the rest characters
    assert TOK.decode(ids, skip_special_tokens=True) == text  # the reward's decode keeps them
    assert TOK.unk_token_id not in ids

def test_the_bootstrap_masks_the_tools_answer_out_of_its_loss():
    prompt = prompt_text(12, 345)
    parts = tool_completion(12, 345)
    batch = supervised_batch(TOK, [(prompt, parts), (prompt, "".join(t for t, _ in parts))])
    masked, whole = batch["labels"]
    assert batch["input_ids"][0].tolist() == batch["input_ids"][1].tolist()  # the same tokens
    n_prompt, n_obs = len(TOK.encode(prompt)), len(TOK.encode(parts[1][0]))
    n_call = len(TOK.encode(parts[0][0]))
    assert (masked[:n_prompt] == -100).all() and (masked[n_prompt:n_prompt + n_call] != -100).all()
    assert (masked[n_prompt + n_call:n_prompt + n_call + n_obs] == -100).all()  # the observation: no loss
    assert (whole[n_prompt + n_call:n_prompt + n_call + n_obs] != -100).all()  # as one text it would be trained
    assert masked[n_prompt + n_call + n_obs:].tolist() == whole[n_prompt + n_call + n_obs:].tolist()

def test_the_traces_use_the_tool_some_of_the_time_whatever_the_length():
    pairs = arith_tool_pairs(0, (200, 0))
    drawn = [next(pairs) for _ in range(4000)]
    tool = [(p, c) for p, c in drawn if not isinstance(c, str)]
    assert abs(len(tool) / len(drawn) - TOOL_SHARE) < 0.03
    longest = [max(map(len, p.rstrip("=").split("+"))) for p, _ in tool]
    assert max(longest) >= 7 and min(longest) == 1  # short and long problems both
    # The problem stream is tiny_arith's: same prompts in the same order.
    arith = bootstrap_task("tiny_arith").pairs(0, (200, 0))
    assert [p for p, _ in drawn[:50]] == [next(arith)[0] for _ in range(50)]
    assert bootstrap_task("tiny_arith_tool").words == TOOL_WORDS
