"""A Hugging Face transformers causal LM (built from its config: no download) under zero1, your loop.

    pip install 'lowcomm[hf]'
    torchrun --nproc-per-node 2 examples/hf_model.py
"""
import torch
import torch.distributed as dist

import lowcomm
from lowcomm.data import load_bytes

dist.init_process_group("gloo")                                 # torchrun gives rank and world size
torch.manual_seed(0)
model = lowcomm.build_hf_causal_lm("gpt2", vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=128)
# Or any PreTrainedModel you built yourself, e.g.
#   from transformers import AutoConfig, AutoModelForCausalLM
#   model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", ...))
tokens, _ = load_bytes("shakespeare", quiet=True)               # bundled corpus, byte-level (vocab 256)
data = torch.from_numpy(tokens[: len(tokens) // 2].astype("int64"))

with lowcomm.wrap(model, lambda p: torch.optim.AdamW(p, lr=3e-3), strategy="zero1", accum=2) as run:
    g = torch.Generator().manual_seed(dist.get_rank())          # each rank its own windows
    while run.steps < 100:
        starts = torch.randint(0, len(data) - 64, (8,), generator=g)
        ids = torch.stack([data[s:s + 64] for s in starts])
        loss = run.model(input_ids=ids, labels=ids).loss        # the model's own shifted LM loss
        if run.backward(loss) is not None and run.steps % 25 == 0 and dist.get_rank() == 0:
            print(f"step {run.steps}: loss {run.result.loss:.3f}, {run.result.tokens} tokens this rank")
dist.destroy_process_group()                                    # after close(): gloo's threads end here, not at exit
