"""--init-from DIR: a run starts from saved weights (a transformers save_pretrained directory, or
a lowcomm run), its first loss the one transformers computes for that model on that batch; what
disagrees with DIR (its model, dims, context, vocabulary) is refused in one line before anything
starts."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs the optional extra: pip install 'lowcomm[hf]'")

from model_runs import RUN, first_batches, records, summary, val_loss  # noqa: E402
from tiny_runs import error_line  # noqa: E402

from lowcomm.cli.main import main  # noqa: E402


def save_gpt2(directory, vocab_size=256, n_positions=32, seed=1):
    """A small transformers GPT-2 with random weights, saved as save_pretrained saves it (with
    GPT-2's dropout of 0.1, which a run turns off)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_layer=2, n_head=2, n_embd=32,
                                      bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def hf_loss(model, batch) -> float:
    """transformers' own loss (labels = the inputs, shifted inside the model) on the windows the
    batch was cut from: x followed by y's last token."""
    x, y = batch
    window = torch.cat([x, y[:, -1:]], dim=1)
    with torch.no_grad():
        return float(model(input_ids=window, labels=window).loss)


@pytest.mark.procs
def test_a_run_from_a_save_pretrained_directory_starts_at_transformers_loss(tmp_path, data_file):
    pretrained = save_gpt2(tmp_path / "gpt2")
    out = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--model", "hf:gpt2", "--init-from", str(pretrained),
                 "--data", str(data_file), "--out", str(out)]) == 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(pretrained).eval()
    expected = sum(hf_loss(reference, batch) for batch in first_batches(data_file)) / 2  # the ranks' mean
    first = records(out)[0]
    assert first["step"] == 1 and first["loss"] == pytest.approx(expected, abs=1e-5)
    # the run's final model: save_pretrained's layout, loaded by transformers, the trained weights
    final = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert final.config.n_layer == 2 and final.config.vocab_size == 256
    assert val_loss(final, data_file) == pytest.approx(summary(out)["final_val_loss"], abs=1e-5)
    assert not torch.equal(final.transformer.wte.weight, reference.transformer.wte.weight)  # it trained
    from lowcomm.data.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(out / "model")  # the byte-level tokenizer.json: id = byte value
    assert tokenizer.encode("It é") == list("It é".encode()) and tokenizer.decode([73, 116]) == "It"


def refusal(capfd, tmp_path, *flags) -> str:
    """The one error line of a run refused before it starts (exit 2, no output directory)."""
    out = tmp_path / "refused"
    assert main(["train", *RUN, "--steps", "1", "--out", str(out), *flags]) == 2
    assert not out.exists()
    return error_line(capfd.readouterr().err)


def test_what_disagrees_with_the_saved_model_is_refused_in_one_line(tmp_path, data_file, capfd):
    pretrained = str(save_gpt2(tmp_path / "gpt2"))
    data = ["--data", str(data_file)]
    line = refusal(capfd, tmp_path, "--init-from", pretrained, "--model", "hf:llama", *data)
    assert "--model hf:llama disagrees with --init-from" in line and "--model hf:gpt2" in line, line
    line = refusal(capfd, tmp_path, "--init-from", pretrained, "--model", "small", *data)
    assert "--model small disagrees" in line and "'gpt2' model" in line, line
    line = refusal(capfd, tmp_path, "--init-from", pretrained, "--n-layer", "3", *data)
    assert "--n-layer 3 disagrees with --init-from" in line and "2 layers" in line, line
    line = refusal(capfd, tmp_path, "--init-from", pretrained, "--seq-len", "64", *data)
    assert "--seq-len 64 is longer" in line and "context of 32 positions" in line, line
    wide = str(save_gpt2(tmp_path / "wide", vocab_size=300))
    line = refusal(capfd, tmp_path, "--init-from", wide, *data)
    assert "vocabulary of 300 tokens, but the data has 256" in line, line


def test_a_directory_that_holds_no_model_is_named(tmp_path, data_file, capfd):
    data = ["--data", str(data_file)]
    line = refusal(capfd, tmp_path, "--init-from", str(tmp_path / "missing"), *data)
    assert line == f"error: --init-from '{tmp_path / 'missing'}' is not a directory", line
    (tmp_path / "empty").mkdir()
    line = refusal(capfd, tmp_path, "--init-from", str(tmp_path / "empty"), *data)
    assert "holds no model: no config.json" in line, line
    bins = tmp_path / "bins"
    bins.mkdir()
    save_gpt2(bins)
    for f in bins.glob("*.safetensors"):
        f.unlink()
    line = refusal(capfd, tmp_path, "--init-from", str(bins), *data)
    assert "holds no safetensors weights" in line, line


def test_a_saved_model_fills_in_what_was_left_out(tmp_path):
    """--init-from sets the model, its dims and (the default being longer) the sequence length, so
    the config that the memory check and the summary read is the model that runs."""
    from lowcomm import config as C
    pretrained = save_gpt2(tmp_path / "gpt2")
    cfg = C.RunConfig()
    C.set_value(cfg, "model.init_from", str(pretrained))
    C.validate(cfg)
    m = cfg.model
    assert (m.preset, m.dims(), m.seq_len) == ("hf:gpt2", (2, 2, 32), 32)
    C.validate(cfg)  # again (a worker validates what the launcher wrote): the same, no refusal
    assert (m.preset, m.dims(), m.seq_len) == ("hf:gpt2", (2, 2, 32), 32)


def test_the_gpt2_preset_has_1024_positions(tmp_path, data_file, capfd):
    line = refusal(capfd, tmp_path, "--model", "gpt2", "--seq-len", "2048", "--data", str(data_file))
    assert line == "error: --seq-len 2048 is longer than the context of --model gpt2 (1024 positions)", line
    from lowcomm.config import RunConfig
    from lowcomm.models import build_model
    from lowcomm.models.layout import meta_layout
    cfg = RunConfig().model
    cfg.preset = "gpt2"
    layout = meta_layout(lambda: build_model(cfg, 50257, 0, torch.device("meta")))
    assert (1024, 768) in layout.shapes  # the position embedding
    assert 123e6 < layout.numel < 125e6  # GPT-2 small's 124M, less its biases
