"""Hugging Face causal LMs built by config (the optional ``hf`` extra)."""
import math
import os
import subprocess
import sys

import pytest
import torch

# Guard: nothing in here may touch the network. Set before transformers /
# huggingface_hub are imported so any accidental download fails loudly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("transformers", reason="needs the optional extra: pip install 'lowcomm[hf]'")

# `import lowcomm` must not import transformers. Checked in a fresh interpreter,
# started now so that its (torch) import overlaps with this module's.
_IMPORT_CHECK = subprocess.Popen(
    [sys.executable, "-c",
     "import lowcomm, lowcomm.models, sys; assert 'transformers' not in sys.modules, "
     "'import lowcomm imported transformers'"],
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

import lowcomm  # noqa: E402
from lowcomm.errors import UsageError  # noqa: E402
from lowcomm.models import build_hf_causal_lm, hf_available, lm_loss  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

SMALL = dict(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)
ARCHS = [a for a in ("gpt2", "llama", "gpt_neox", "qwen2") if a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is fastest, and keeps the tests fast on a
    busy machine (spinning OpenMP threads made AdamW steps ~50x slower there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if _IMPORT_CHECK.poll() is None:  # test deselected: do not leave it behind
        _IMPORT_CHECK.kill()
        _IMPORT_CHECK.communicate()


def build(arch, seed=0, **kw):
    torch.manual_seed(seed)
    return build_hf_causal_lm(arch, **{**SMALL, **kw})


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def random_bytes(seed, batch=4, length=SMALL["seq_len"]):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length + 1), generator=g)


def test_hf_available():
    assert hf_available() is True


def test_import_lowcomm_does_not_import_transformers():
    out, _ = _IMPORT_CHECK.communicate(timeout=300)
    assert _IMPORT_CHECK.returncode == 0, out


@pytest.mark.parametrize("arch", ARCHS)
def test_builds_small_model_with_given_dims(arch):
    model = build(arch)
    cfg = model.config
    assert cfg.vocab_size == 256
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 2 and cfg.num_attention_heads == 4
    assert cfg.max_position_embeddings == 32
    assert cfg.use_cache is False
    assert model.get_input_embeddings().weight.shape == (256, 64)
    assert model.get_output_embeddings().weight.shape == (256, 64)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # Small: the published defaults (MLP width 11008, 32 kv heads, ...) are not used.
    assert n_params(model) < 300_000
    for key, value in cfg.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            assert value == 0.0, key


@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_scales_with_dims(arch):
    base = n_params(build(arch))
    # Each extra layer adds the same number of parameters.
    three = n_params(build(arch, n_layer=3))
    four = n_params(build(arch, n_layer=4))
    assert base < three < four and four - three == three - base
    # A block is attention 4 d^2 + MLP with width 4 d: 8 d^2 (gpt2, gpt_neox, like
    # lowcomm's GPT) or 12 d^2 when gated (llama, qwen2: gate, up and down), plus
    # norms and biases.
    per_layer = (three - base) / 64 ** 2
    gated = arch in ("llama", "qwen2")
    assert (16 <= per_layer < 16.5) if gated else (12 <= per_layer < 12.5), per_layer
    # Wider model: per-layer cost grows ~4x when d_model doubles.
    wide = n_params(build(arch, d_model=128))
    wide3 = n_params(build(arch, d_model=128, n_layer=3))
    assert 3.9 < (wide3 - wide) / (three - base) < 4.1
    # Vocabulary: input (and, if untied, output) embedding rows.
    assert n_params(build(arch, vocab_size=512)) - base in (256 * 64, 2 * 256 * 64)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_builds_on_the_meta_device(arch):
    """lowcomm checks a model's config by building it on the meta device."""
    with torch.device("meta"):
        model = build(arch)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert n_params(model) == n_params(build(arch))


def test_gpt2_ties_embeddings_llama_does_not():
    gpt2, llama = build("gpt2"), build("llama")
    assert gpt2.get_output_embeddings().weight is gpt2.get_input_embeddings().weight
    assert llama.get_output_embeddings().weight is not llama.get_input_embeddings().weight
    tied = build("llama", tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert n_params(tied) == n_params(llama) - 256 * 64


@pytest.mark.parametrize("arch", ARCHS)
def test_deterministic_build(arch):
    a, b = build(arch, seed=0), build(arch, seed=0)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = build(arch, seed=1)
    assert not torch.equal(a.get_input_embeddings().weight, c.get_input_embeddings().weight)


@pytest.mark.parametrize("arch", ARCHS)
def test_first_loss_near_ln_vocab(arch):
    model = build(arch)
    x = random_bytes(0)
    with torch.no_grad():
        loss = lm_loss(model, (x[:, :-1], x[:, 1:]))
    assert abs(float(loss) - math.log(256)) < 0.3


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_adamw_steps_reduce_loss(arch):
    model = build(arch)
    x = random_bytes(1)
    batch = (x[:, :-1], x[:, 1:])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = lm_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_training_is_deterministic_without_dropout():
    """Train mode (what transformers returns) gives the same loss twice: no dropout."""
    model = build("gpt2")
    assert model.training
    x = random_bytes(2)
    l1, l2 = (lm_loss(model, (x[:, :-1], x[:, 1:])).item() for _ in range(2))
    assert l1 == l2


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dict_batch_uses_hf_loss(arch):
    model = build(arch)
    x = random_bytes(3)[:, :SMALL["seq_len"]]
    with torch.no_grad():
        hf_loss = model(input_ids=x, labels=x).loss
        # HF shifts labels itself; the tuple form takes pre-shifted targets.
        tuple_loss = lm_loss(model, (x[:, :-1], x[:, 1:]))
        dict_loss = lm_loss(model, {"input_ids": x, "labels": x,
                                    "attention_mask": torch.ones_like(x)})
    assert torch.equal(dict_loss, hf_loss)
    torch.testing.assert_close(tuple_loss, hf_loss)


def test_dict_batch_without_labels_is_a_clear_error():
    model = build("gpt2")
    with pytest.raises(ValueError, match="no loss.*include 'labels'"):
        lm_loss(model, {"input_ids": random_bytes(4)[:, :-1]})


def test_lm_loss_unchanged_for_lowcomm_gpt():
    torch.manual_seed(0)
    model = lowcomm.GPT(vocab_size=256, seq_len=32, n_layer=1, n_head=2, d_model=32)
    x = random_bytes(5)
    x, y = x[:, :-1], x[:, 1:]
    logits = model(x)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    assert torch.equal(lm_loss(model, (x, y)), expected)
    assert torch.equal(lm_loss(model, [x, y]), expected)


def test_lm_loss_accepts_dict_output():
    class DictModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 256)

        def forward(self, x):
            return {"logits": self.emb(x)}

    model = DictModel()
    x = random_bytes(6)
    loss = lm_loss(model, (x[:, :-1], x[:, 1:]))
    logits = model.emb(x[:, :-1])
    assert torch.equal(loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                               x[:, 1:].reshape(-1)))


def test_overrides_pass_through():
    model = build("llama", intermediate_size=96, num_key_value_heads=2, attention_dropout=0.1)
    assert model.config.intermediate_size == 96
    assert model.config.num_key_value_heads == 2
    assert model.config.attention_dropout == 0.1
    assert model.model.layers[0].mlp.up_proj.out_features == 96
    assert build("llama", attn_implementation="eager").config._attn_implementation == "eager"
    # GPT-2 spells the MLP width n_inner.
    assert build("gpt2", n_inner=100).transformer.h[0].mlp.c_fc.nf == 100


def test_architecture_name_forms():
    assert type(build("LlamaForCausalLM")).__name__ == "LlamaForCausalLM"
    assert build("GPT2").config.model_type == "gpt2"


# --- one-line usage errors -------------------------------------------------------------

def one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_unknown_architecture_is_named_with_known_ones():
    with pytest.raises(UsageError, match=r"unknown Hugging Face architecture 'gtp2'.*"
                                         r"did you mean 'gpt2'.*gpt2, llama") as e:
        build("gtp2")
    one_line(e)
    with pytest.raises(UsageError, match=r"unknown .*'no-such-model'.* gpt2, llama"):
        build("no-such-model")


def test_non_causal_architecture_is_refused():
    with pytest.raises(UsageError, match=r"'t5' is not a causal language model") as e:
        build("t5")
    one_line(e)


def test_composite_model_points_to_its_text_model():
    if "gemma3_text" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma3")
    with pytest.raises(UsageError, match=r"'gemma3' is a composite .*use 'gemma3_text'") as e:
        build("gemma3")
    one_line(e)


def test_d_model_not_divisible_by_n_head():
    with pytest.raises(UsageError, match=r"d_model=65 is not divisible by n_head=4") as e:
        build("gpt2", d_model=65)
    one_line(e)


@pytest.mark.parametrize("name", ["n_layer", "n_head", "d_model", "seq_len", "vocab_size"])
def test_non_positive_dims(name):
    with pytest.raises(UsageError, match=rf"{name} must be a positive integer, got 0"):
        build("llama", **{name: 0})


def test_dims_the_model_rejects_name_the_value():
    # 4 query heads cannot share 3 key/value heads.
    with pytest.raises(UsageError, match=r"'llama'.*n_head=4 is not divisible by "
                                         r"num_key_value_heads=3") as e:
        build("llama", num_key_value_heads=3)
    one_line(e)
    # Whatever transformers itself rejects comes back as one line naming the dims.
    with pytest.raises(UsageError, match=r"cannot build a Hugging Face 'llama' model "
                                         r"\(vocab_size=256, seq_len=32, n_layer=2, n_head=4, "
                                         r"d_model=64\).*no_such_act") as e:
        build("llama", hidden_act="no_such_act")
    one_line(e)


def test_bad_overrides():
    with pytest.raises(UsageError, match=r"unknown config override 'intermediate_sise'.*"
                                         r"did you mean 'intermediate_size'"):
        build("llama", intermediate_sise=10)
    with pytest.raises(UsageError, match=r"through d_model=.*n_embd=128"):
        build("gpt2", n_embd=128)
    with pytest.raises(UsageError, match=r"through n_layer=.*num_hidden_layers=3"):
        build("llama", num_hidden_layers=3)


def test_missing_transformers_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(UsageError, match=r"pip install 'lowcomm\[hf\]'") as e:
        build("gpt2")
    one_line(e)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_built_models_are_causal(arch):
    """No position sees a later token -- bert too, which transformers also maps to a causal LM
    but which attends both ways unless its config says is_decoder."""
    torch.manual_seed(0)
    model = build_hf_causal_lm(arch, vocab_size=256, seq_len=32, n_layer=1, n_head=2, d_model=32)
    x = torch.randint(0, 256, (1, 16))
    changed = x.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(input_ids=x).logits[0, :-1], model(input_ids=changed).logits[0, :-1])
