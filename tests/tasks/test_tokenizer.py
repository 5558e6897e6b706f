import pytest

from jaxspec.tasks import SPECIAL_TOKENS, ChatTokenizer, format_prompt, generate_problems, train_tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    problems = generate_problems(1500, seed=0, levels=(1, 2, 3, 4, 5))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer((t for p in problems for t in (p["question"], p["solution"])), 400, path)
    return ChatTokenizer.from_file(path), problems


def test_round_trip_and_special_ids(trained):
    tok, problems = trained
    assert tok.vocab_size <= 400
    assert [tok.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    texts = [t for p in problems for t in (p["question"], p["solution"])]
    texts += ["  leading spaces, tabs\tand ünïcödé — 1,234.5 ∑ \\frac{3}{4}\n\n", "-0.75 $12"]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_digits_are_single_tokens(trained):
    tok, _ = trained
    pieces = tok.tokenizer.encode("12345 + 678", add_special_tokens=False).tokens
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert all(sum(c.isdigit() for c in p) == 1 for p in digit_pieces)
    assert len(digit_pieces) == 8


def test_chat_convention(trained):
    tok, problems = trained
    p = problems[0]
    prompt = tok.encode_prompt(p["question"])
    assert prompt[:2] == [tok.bos_id, tok.tokenizer.token_to_id("<|user|>")]
    assert tok.tokenizer.token_to_id("<|assistant|>") in prompt
    assert format_prompt("Q?") == "<|bos|><|user|>\nQ?\n<|assistant|>\n"
    response = tok.encode_response(p["solution"])
    assert response[-1] == tok.eos_id and tok.eos_id not in response[:-1]
    # decoding stops at eos and drops special tokens
    assert tok.decode(response + tok.encode("junk")) == p["solution"]
    assert tok.decode(prompt) == f"\n{p['question']}\n\n"


def test_other_tokenizers_and_errors(tmp_path, trained):
    tok, _ = trained
    path = tmp_path / "tokenizer.json"
    tok.tokenizer.save(str(path))
    custom = ChatTokenizer.from_file(
        tmp_path, eos_token="<|user|>", pad_token="<|eos|>", bos_token=None, prompt_template="Q: {question}\nA:"
    )
    assert (custom.eos_id, custom.pad_id, custom.bos_id) == (3, 2, None)
    assert custom.decode(custom.encode_prompt("hi")) == "Q: hi\nA:"
    with pytest.raises(ValueError, match="eos_token '<\\|end\\|>'"):
        ChatTokenizer.from_file(path, eos_token="<|end|>")
    with pytest.raises(ValueError, match="question"):
        ChatTokenizer.from_file(path, prompt_template="no slot")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        ChatTokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["a"], 100)
