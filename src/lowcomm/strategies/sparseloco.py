"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, arXiv 2508.15706): DiLoCo whose outer
gradient is sent top-k sparse at 2 bits, with a decaying error-feedback buffer in place of
the outer momentum. A preset of diloco (different option defaults, the same code):

    every worker starts from the global θ; H = 15 inner AdamW steps
    Δ_r = θ_global − θ_r
    e_r ← β·e_r + Δ_r                          β = 0.95         (--outer-ef-decay)
    Δ̂_r = Q₂(top-k per chunk of e_r)           k = 64 of 4096   (--outer-compress)
    e_r ← e_r − Δ̂_r
    all_gather (indices, codes) of every worker; Δ = at each index, the mean of the
    values of the workers that sent it
    θ_global ← θ_global − α·Δ                  α = 1, no momentum (--outer-lr, --outer-momentum)

Matched, from the authors' code (github.com/tplr-ai/SparseLoCo, first published as CCLoco;
read in its mirror tplr-y/CCLoco: src/tplr/ccloco.py, class CCLoco.step and
TopKCompressor; hparams/500M/sweeps/ccloco.yaml) and the paper:
- H = 15 inner steps, outer lr 1, error_decay 0.95 (ccloco.yaml: inner_steps, outer_learning_rate,
  error_decay); the outer step is plain SGD without momentum (CCLoco's momentum default 0):
  the error-feedback buffer stands in for DiLoCo's outer momentum (the paper's key observation);
- error feedback on the outer gradient: decay, add, compress, subtract what was sent -- its
  locally *decoded* value, so the quantization error stays in the buffer too (step(), 2.-4.);
- top-k by magnitude within chunks of 4096 values (chunk_size 64 -> 64×64 tiles); k = 64
  (1.56%), the middle of the paper's 1–3% (the reference sweeps use 32 and 128);
- 2-bit values by their statistical quantizer (TopKCompressor._quantize with quantization_bins
  4, quantization_range 6): shift by the mean, step 6σ/4, 4 codes, decoded through each
  code's mean value (lowcomm.compress.ValueCodec "stat"), over the tensor's own selected values
  only: where a short tensor's padded chunk makes top-k pick padding, the padding is in no
  statistic (the reference clamps k to the short tensor);
- aggregation: all-gather of indices and values, each index averaged over the workers that
  sent it (batch_decompress: scatter_reduce "mean", include_self=False).
- per tensor: each tensor's top-k chunks and its quantizer's mean/σ/table are its own
  (compress.PerTensor), as the reference compresses parameter by parameter; so replica
  groups whose ranks own whole tensors send exactly what one worker would.
Where lowcomm differs (and why):
- chunks are 4096 consecutive values of each flattened tensor (its last chunk zero-padded), not
  64×64 tiles of each matrix and 64-value chunks of vectors: one compressor serves every
  strategy; the selection is still per 4096 values of one tensor, and a vector of ≤ 64 values
  is sent whole, as the reference's (k clamped to its chunk);
- on the wire, 16-bit indices (a 4096 chunk needs 12) and packed 2-bit codes; the reference
  sends int64 indices and a byte per code (the paper counts bits);
- the buffer accumulates Δ and the outer SGD multiplies by α; the reference accumulates α·Δ
  and steps with α: the same at the preset's α = 1;
- the inner optimizer is the run's (--lr, --weight-decay, --warmup ...): the paper's AdamW
  lr 1e-3, weight decay 0.1, 500 warmup steps, gradient clipping 1.0 are run flags, not this
  preset's.
Every flag of diloco still applies (`--outer-compress`, `--sync-every`, `--sync-by time`, ...).

Under --score (Covenant's validator, engines/outer_scoring.py) a worker is left out at its first
negative score, not its third as diloco's (--score-patience 1): the decode takes a coordinate only
one worker sent at that worker's full value (DiLoCo's mean takes 1/W of it), so each round a bad
contribution is admitted costs up to W times what it costs DiLoCo, while leaving an honest worker
out for a round costs that round's share of its top-k. Measured (bench/byzantine.py, W=4, seed 0,
median-norm-clip): a sign-flipper admitted for the two rounds patience 3 allows ended +6.1 %
against the attack-free run, one left out from round 0 +3.1 %, bit for bit the run whose fourth
worker sends nothing: the floor of any defence here (docs/untrusted.md: three senders' top-k move
fewer coordinates a round than four).

Early in a run the outer step raises the loss (30 steps, W=2: 3.43 -> 5.19 across the first):
a sync carries 1.6 % of the values of a period's move and the workers restart from θ_global.
The defaults stay the authors' (their top-k and inner lr do worse here; their runs are long
enough for error feedback to catch up, as lowcomm's 200 steps are): docs/strategies.md.
"""
from __future__ import annotations

from .diloco import DiLoCo, DiLoCoOptions
from ..contract.options import with_defaults
from .registry import register

SPARSELOCO_SPEC = "topk:64,chunk:4096,bits:2,quant:stat"
SPARSE_SCORE_PATIENCE = 1  # --score: out at the first negative score, back at the first non-negative (above)

SparseLoCoOptions = with_defaults(DiLoCoOptions, "SparseLoCoOptions", __name__, sync_every=15, outer_lr=1.0,
                                  outer_momentum=0.0, outer_compress=SPARSELOCO_SPEC, outer_ef_decay=0.95,
                                  score_patience=SPARSE_SCORE_PATIENCE)


@register("sparseloco")
class SparseLoCo(DiLoCo):
    Options = SparseLoCoOptions
    inside_replica = ("ddp", "fsdp")  # across replica groups: on the tensors each position owns (fsdp: its shards)
