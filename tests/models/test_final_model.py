"""Every run leaves its final model in OUT/model/ (gathered where FSDP shards it), whole or not at
all; a later run continues from it with --init-from; --activation-checkpointing computes the same
loss and gradients; --compile is refused in one line where its backend cannot run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from model_runs import RUN, first_batches, records, summary, val_loss
from tiny_runs import error_line

from lowcomm.cli.main import main
from lowcomm.config import ModelConfig
from lowcomm.errors import UsageError
from lowcomm.models import GPT, build_model, lm_loss
from lowcomm.models.load import load_saved, read_saved
from lowcomm.models.save import full_state, save_model

DIMS = ["--n-layer", "1", "--n-head", "2", "--d-model", "16"]


@pytest.mark.procs
def test_a_sharded_run_leaves_its_trained_model_and_a_run_continues_from_it(tmp_path, data_file, capfd):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", *RUN, *DIMS, "--steps", "3", "--replicas", "1", "--inside", "fsdp",
                 "--data", str(data_file), "--out", str(first)]) == 0
    saved = read_saved(first)  # the run directory: its model/
    assert saved.path == first / "model" and saved.dims == (1, 2, 16) and saved.context == 16
    assert json.loads((first / "model" / "config.json").read_text())["architecture"] == "lowcomm_gpt"
    trained = load_saved(saved, torch.device("cpu"), vocab_size=256)
    assert val_loss(trained, data_file) == pytest.approx(summary(first)["final_val_loss"], abs=1e-5)

    # a preset of other dims, or an hf: model, is refused naming the saved model (nothing written)
    assert main(["train", *RUN, "--steps", "1", "--init-from", str(first), "--model", "gpt2", "--data",
                 str(data_file), "--out", str(second)]) == 2
    assert error_line(capfd.readouterr().err) == (
        f"error: --model gpt2 (12, 12, 768) disagrees with --init-from '{first}', which holds lowcomm's GPT "
        f"(1 layer, 2 heads, width 16, vocabulary 256, context 16) (leave --model out)")
    assert not second.exists()
    assert main(["train", *RUN, "--steps", "1", "--init-from", str(first), "--data", str(data_file),
                 "--out", str(second)]) == 0
    with torch.no_grad():
        expected = sum(float(lm_loss(trained, batch)) for batch in first_batches(data_file)) / 2
    assert records(second)[0]["loss"] == pytest.approx(expected, abs=1e-5)
    assert records(first)[0]["loss"] != pytest.approx(expected, abs=1e-3)  # not the random start: trained
    assert read_saved(second).dims == (1, 2, 16)


def tiny_gpt(seed=0, context=16):
    torch.manual_seed(seed)
    return GPT(256, context, 1, 2, 16)


def test_the_model_directory_appears_whole_or_not_at_all(tmp_path):
    model, target = tiny_gpt(), tmp_path / "model"
    with pytest.raises(OSError):  # the tokenizer to copy is missing: nothing is left behind
        save_model(model, full_state(model), target, 16, {"tokenizer.json": tmp_path / "missing.json"})
    assert list(tmp_path.iterdir()) == []
    save_model(model, full_state(model), target, 16, {"tokenizer.json": b"{}"})
    newer = tiny_gpt(seed=1)
    save_model(newer, full_state(newer), target, 16)  # a directory written over: replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    probe = tmp_path / "probe"
    probe.write_bytes(b"")  # a file as the umask makes it: the weights too (safetensors writes them 0600)
    assert {p.stat().st_mode & 0o777 for p in target.iterdir()} == {probe.stat().st_mode & 0o777}
    loaded = load_saved(read_saved(target), torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), newer.state_dict().values()))
    assert loaded.head.weight is loaded.tok_emb.weight  # still tied


def test_a_saved_model_that_does_not_fit_its_config_is_refused(tmp_path):
    model = tiny_gpt()
    save_model(model, full_state(model), tmp_path / "model", 16)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "d_model": 32}))
    with pytest.raises(UsageError, match=r"model.safetensors' does not fit its config.json: it has tok_emb.weight "
                                         r"of shape \[256, 16\], not \[256, 32\]"):
        load_saved(read_saved(tmp_path), torch.device("cpu"))


def loss_and_grads(model_cfg: ModelConfig, batch):
    model = build_model(model_cfg, 256, 0, torch.device("cpu"))
    calls = []
    # the first layer of the first block: a recompute runs it again (it may stop before the block's end)
    first = model.blocks[0].ln1 if isinstance(model, GPT) else model.transformer.h[0].ln_1
    first.register_forward_pre_hook(lambda *_: calls.append(1))
    loss = lm_loss(model, batch)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], len(calls)


@pytest.mark.parametrize("preset", ["tiny", "hf:gpt2"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(preset):
    if preset.startswith("hf:"):
        pytest.importorskip("transformers", reason="needs the optional extra: pip install 'lowcomm[hf]'")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    plain = ModelConfig(preset=preset, n_layer=2, n_head=2, d_model=16, seq_len=16)
    checkpointed = ModelConfig(preset=preset, n_layer=2, n_head=2, d_model=16, seq_len=16,
                               activation_checkpointing=True)
    loss, grads, forwards = loss_and_grads(plain, batch)
    loss_c, grads_c, forwards_c = loss_and_grads(checkpointed, batch)
    assert (forwards, forwards_c) == (1, 2)  # the block ran again in backward: its activations were not kept
    assert loss_c == pytest.approx(loss, abs=1e-6)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(grads, grads_c))


def test_compile_is_refused_in_one_line_without_a_compiler(tmp_path, data_file, capfd, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's backend is the one checked
    out = tmp_path / "run"
    assert main(["train", *RUN, *DIMS, "--steps", "1", "--compile", "--device", "cpu", "--data", str(data_file),
                 "--out", str(out)]) == 2
    line = error_line(capfd.readouterr().err)
    assert line == (f"error: --compile: torch.compile on the CPU needs a C++ compiler, and '{tmp_path / 'no-such-c++'}'"
                    f" is not found (install g++, or set CXX), or leave --compile out"), line
    assert not out.exists()


def test_compile_compiles_the_model_in_place_where_a_compiler_is_there(monkeypatch):
    """Compiling happens at the first forward (tens of seconds on the CPU: not run here); the
    model is the same module, its state dict under the same names, so saving and loading hold."""
    from lowcomm.models.build import compile_refusal
    if compile_refusal("cpu"):
        pytest.skip(compile_refusal("cpu"))
    model = build_model(ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=16, compile=True), 256, 0,
                        torch.device("cpu"))
    assert isinstance(model, GPT) and model._compiled_call_impl is not None
    assert "tok_emb.weight" in model.state_dict()


@pytest.mark.procs
def test_a_checkpoint_holds_the_model_its_step_evaluated_and_a_run_starts_from_it(tmp_path, data_file, capfd):
    """DiLoCo mid-period (step 3 of periods of 2): each worker trains its own θ, the model evaluated
    is the global one; a checkpoint's model/ is that one (its validation loss is the one the run
    logged at that step; the worker's own θ fails this)."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", *RUN, *DIMS, "--strategy", "diloco", "--sync-every", "2", "--steps", "4",
                 "--checkpoint-every", "3", "--eval-every", "3", "--data", str(data_file), "--out", str(first)]) == 0
    checkpoint = first / "ckpt-000003"
    saved = read_saved(checkpoint)
    assert saved.path == checkpoint / "model" and (saved.path / "tokenizer.json").is_file()
    logged = next(r["val_loss"] for r in records(first) if r["step"] == 3 and "val_loss" in r)
    assert val_loss(load_saved(saved, torch.device("cpu"), vocab_size=256), data_file) == pytest.approx(logged, abs=1e-5)

    # a run that left no final model (killed before its end) points at its newest checkpoint (the last step's)
    shutil.rmtree(first / "model")
    with pytest.raises(UsageError, match=f"the newest is {first / 'ckpt-000004'}, or finish it"):
        read_saved(first)
    assert main(["train", *RUN, "--steps", "1", "--init-from", str(checkpoint), "--data", str(data_file),
                 "--out", str(second)]) == 0
    assert records(second)[0]["loss"] < records(first)[0]["loss"]  # from the trained weights, not a random start
