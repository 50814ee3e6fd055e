"""`lowcomm sample RUNDIR --prompt TEXT`: text from a run's final model with its tokenizer, the
same text for the same seed; the generation loop's choices (temperature 0, top-k, the context)."""
from __future__ import annotations

import pytest
import torch

from tiny_runs import error_line

from lowcomm.cli.main import main
from lowcomm.data.tokenizer import byte_level_tokenizer
from lowcomm.models import GPT
from lowcomm.models.gpt import logits_of
from lowcomm.models.sample import generate, next_token
from lowcomm.models.save import full_state, save_model

PROMPT = "It is a truth"
BYTE_TOKENIZER = byte_level_tokenizer().to_str().encode()  # what a run on byte text leaves beside its model


def saved_run(tmp_path, vocab_size=256, context=8):
    """A run directory holding what a run leaves: model/ with the byte tokenizer beside."""
    torch.manual_seed(0)
    model = GPT(vocab_size, context, 1, 2, 16)
    save_model(model, full_state(model), tmp_path / "run" / "model", context, {"tokenizer.json": BYTE_TOKENIZER})
    return tmp_path / "run", model


def sample(capsys, *args) -> str:
    assert main(["sample", *map(str, args)]) == 0
    return capsys.readouterr().out


def greedy(model, prompt: list[int], n: int, context: int) -> list[int]:
    """The likeliest next token, n times, each from the last `context` tokens: written out here."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(logits_of(model(torch.tensor([ids[-context:]])))[0, -1].argmax()))
    return ids[len(prompt):]


def test_sampling_continues_the_prompt_the_same_for_the_same_seed(tmp_path, capsys):
    run, model = saved_run(tmp_path)
    first = sample(capsys, run, "--prompt", PROMPT, "--max-tokens", 30, "--seed", 1)
    assert first.startswith(PROMPT) and len(first.encode()) >= len(PROMPT) + 1
    assert sample(capsys, run, "--prompt", PROMPT, "--max-tokens", 30, "--seed", 1) == first
    assert sample(capsys, run, "--prompt", PROMPT, "--max-tokens", 30, "--seed", 2) != first
    # no prompt: a new document, after a newline (the tokenizer's end-of-text id, 256, is not the model's)
    expected = greedy(model, [10], 5, context=8)
    assert sample(capsys, run, "--max-tokens", 5, "--temperature", 0) == bytes(expected).decode(errors="replace") + "\n"
    assert sample(capsys, run, "--tokenizer", "bytes", "--max-tokens", 5, "--temperature", 0) == \
        bytes(expected).decode(errors="replace") + "\n"
    # temperature 0 and top-k 1 both take the likeliest token; the prompt (13 bytes) is longer than
    # the model's context (8): the window slides
    expected = greedy(model, list(PROMPT.encode()), 12, context=8)
    text = bytes(expected).decode("utf-8", errors="replace")
    greedy_text = PROMPT + text + "\n"
    assert sample(capsys, run / "model", "--prompt", PROMPT, "--max-tokens", 12, "--temperature", 0) == greedy_text
    assert sample(capsys, run, "--prompt", PROMPT, "--max-tokens", 12, "--top-k", 1, "--seed", 5) == greedy_text


def test_top_k_draws_only_among_the_k_likeliest():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, -2.0]])
    g = torch.Generator().manual_seed(0)
    drawn = {int(next_token(logits, 1.0, 2, g)) for _ in range(200)}
    assert drawn == {1, 3}
    assert int(next_token(logits, 0.0, 0, g)) == 1


def test_generate_returns_only_the_new_tokens():
    torch.manual_seed(0)
    model = GPT(256, 8, 1, 2, 16)
    g = torch.Generator().manual_seed(0)
    out = generate(model, [1, 2, 3], 5, context=8, temperature=0.7, top_k=10, generator=g)
    assert len(out) == 5 and all(0 <= i < 256 for i in out)
    assert model.training  # left as it was


def test_bad_input_is_one_line(tmp_path, capfd):
    run, _ = saved_run(tmp_path, vocab_size=100)
    cases = [([tmp_path], f"RUNDIR '{tmp_path}' holds no model"),
             ([tmp_path / "missing"], "is not a directory"),
             ([run, "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
             ([run, "--temperature", "-1"], "--temperature must be a finite number >= 0"),
             ([run, "--top-k", "-2"], "--top-k must be >= 0"),
             ([run, "--prompt", "é"], "--prompt: the tokenizer gives id 195, beyond the model's vocabulary of 100")]
    for args, words in cases:
        assert main(["sample", *map(str, args)]) == 2, args
        line = error_line(capfd.readouterr().err)
        assert words in line, (args, line)
    (run / "model" / "tokenizer.json").unlink()
    assert main(["sample", str(run)]) == 2
    assert "holds no tokenizer" in error_line(capfd.readouterr().err)


def test_a_transformers_model_samples_through_the_same_loop(tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="needs the optional extra: pip install 'lowcomm[hf]'")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=16, n_layer=1, n_head=2, n_embd=16,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "gpt2" / "tokenizer.json").write_bytes(BYTE_TOKENIZER)
    out = sample(capsys, tmp_path / "gpt2", "--prompt", PROMPT, "--max-tokens", 20, "--temperature", 0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    expected = greedy(reference, list(PROMPT.encode()), 20, context=16)
    assert out == PROMPT + bytes(expected).decode("utf-8", errors="replace") + "\n"
