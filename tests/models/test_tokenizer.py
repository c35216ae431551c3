import json

from areal_flow.models.tiny import tiny_qwen2_config
from areal_flow.models.tokenizer import CHARS, CODE_CHARS, build_char_tokenizer, load_tokenizer


def test_vocab_is_three_specials_then_fifteen_characters():
    tok = build_char_tokenizer()
    assert len(tok) == 18
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok(CHARS, add_special_tokens=False)["input_ids"] == list(range(3, 18))


def test_encoding_adds_no_special_tokens_and_maps_unknown_chars_to_unk():
    tok = build_char_tokenizer()
    plain = tok("12+3=")["input_ids"]
    assert plain == tok("12+3=", add_special_tokens=False)["input_ids"]
    assert len(plain) == 5 and tok.eos_token_id not in plain
    assert tok("1x\n2")["input_ids"] == [4, 2, 2, 5]


def test_space_survives_save_and_load_beside_a_qwen2_config(tmp_path):
    tok = build_char_tokenizer()
    # A qwen2 config.json in the same folder is what tempts AutoTokenizer into Qwen2Tokenizer.
    tiny_qwen2_config(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    loaded = load_tokenizer(str(tmp_path))
    text = "3+7+0=10;#### 4690"
    ids = loaded(text)["input_ids"]
    assert ids == tok(text)["input_ids"] and len(ids) == len(text)
    assert loaded.decode(ids) == text
    assert loaded.decode(ids + [loaded.eos_token_id, 0], skip_special_tokens=True) == text
    assert len(loaded) == 18 and loaded.pad_token == "<pad>" and loaded.eos_token == "<eos>"


def test_the_code_tokenizer_reads_any_printable_program_and_keeps_the_chat_template(tmp_path):
    tok = build_char_tokenizer(CODE_CHARS, chat=True)
    # 3 specials, newline + 95 printable characters, the two role markers
    assert len(tok) == 101 and (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    program = 'def keep_gt_4(xs):\n    return [x for x in xs if x > 4]  # "ok" ~ {a: 1}\n'
    ids = tok(program)["input_ids"]
    assert len(ids) == len(program) and tok.unk_token_id not in ids and tok.decode(ids) == program
    assert tok("\t")["input_ids"] == [tok.unk_token_id]  # indents are spaces
    chat = tok.apply_chat_template([{"role": "user", "content": "add_3(x)"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nadd_3(x)<|im_end|>\n<|im_start|>assistant\n"
    # a role marker is one token, and it survives save and load with the template
    assert tok(chat)["input_ids"][0] == 99 and len(tok(chat)["input_ids"]) == len(chat) - 2 * 12 - 10 + 3
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded(chat)["input_ids"] == tok(chat)["input_ids"] and loaded.chat_template == tok.chat_template
    assert loaded.decode(tok(chat)["input_ids"], skip_special_tokens=True) == "user\nadd_3(x)\nassistant\n"
