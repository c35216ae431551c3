import json

from areal_flow.models.tiny import tiny_qwen2_config
from areal_flow.models.tokenizer import CHARS, build_char_tokenizer, load_tokenizer


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
