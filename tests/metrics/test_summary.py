"""The end-of-run paragraph says which model each final loss is of: in the local-SGD family the
train loss is the workers' own models' on the last step and the validation loss the global
model's right after that step's outer step, with how far an outer step raised the train loss.
Built from step records written by hand; no process."""
from lowcomm.metrics.summary import Totals, describe

# a sparseloco-like run of 6 steps, H = 3: steps 3 and 6 send an outer gradient, and the step
# after the first outer step trains from a model the outer step moved (loss 3.43 -> 5.19)
LOSSES = {1: 5.56, 2: 4.10, 3: 3.43, 4: 5.19, 5: 3.90, 6: 3.21}


def record(step, loss, wire, **levels):
    return {"step": step, "loss": loss, "tokens": 4096, "wire_bytes": wire, "exposed_comm_s": 0.0,
            "per_rank": {"compute_s": [0.1, 0.1], "exposed_comm_s": [0.0, 0.0], "micro_batches": [1, 1]}, **levels}


def summary(totals: Totals, **report) -> dict:
    return {"strategy": "sparseloco", "workers": 2, "steps": 6, "tokens": totals.tokens, "wall_s": 6.0,
            "tokens_per_s": totals.tokens / 6.0, "final_train_loss": 3.2143, "final_val_loss": 4.5459,
            "wire_bytes_total": totals.wire, "wire_bytes_per_rank_per_step": totals.wire / 12,
            "exposed_comm_fraction": 0.0, "optimizer_state_bytes_per_rank": 8e6, "peak_mem_bytes": 2**28,
            **report, **({"rise_after_outer_step": totals.rise_after_sending,
                          "last_after_outer_step": totals.last_after_sending} if "outer_syncs" in report else {})}


def totals_of(records) -> Totals:
    totals = Totals(2)
    for r in records:
        totals.add(r)
    return totals


def test_validation_after_an_outer_step_is_said_with_the_rise_the_outer_step_caused():
    totals = totals_of(record(s, loss, 84_416 if s % 3 == 0 else 0) for s, loss in LOSSES.items())
    assert totals.rise_after_sending == {"step": 3, "loss_before": 3.43, "loss_after": 5.19}
    text = describe(summary(totals, outer_syncs=2))
    assert ("Final train loss 3.2143 (the workers' own models on the last step, before its outer step), "
            "validation loss 4.5459 (the global model, measured right after that outer step moved it; "
            "the outer step after step 3 raised the train loss most, from 3.43 to 5.19).") in text
    # a longer run: the last outer step followed by a step says how far that one moved the model
    totals.add(record(7, 3.30, 0))
    assert totals.last_after_sending == {"step": 6, "loss_before": 3.21, "loss_after": 3.30}
    assert ("raised the train loss most, from 3.43 to 5.19; across the last one, after step 6, it went from 3.21 "
            "to 3.30)."
            in describe(summary(totals, outer_syncs=2)))


def test_an_outer_step_that_raised_no_loss_is_not_said_to():
    falling = {s: 5.0 - 0.2 * s for s in LOSSES}
    totals = totals_of(record(s, loss, 84_416 if s % 3 == 0 else 0) for s, loss in falling.items())
    text = describe(summary(totals, outer_syncs=2))
    assert "(the global model, measured right after that outer step moved it)." in text and "raised" not in text


def test_with_replica_groups_only_the_bytes_across_mark_an_outer_step():
    # inside a replica every step sends; across, only the outer steps (3 and 6)
    totals = totals_of(record(s, loss, 10_000 + (84_416 if s % 3 == 0 else 0), wire_bytes_intra=10_000,
                              exposed_comm_s_intra=0.0, wire_bytes_cross=84_416 if s % 3 == 0 else 0,
                              exposed_comm_s_cross=0.0) for s, loss in {**LOSSES, 2: 6.0}.items())
    assert totals.rise_after_sending["step"] == 3  # not the noisier step 2, after a step that sent only inside


def test_a_run_without_outer_steps_gives_its_losses_side_by_side_as_before():
    totals = totals_of(record(s, loss, 4_000_000) for s, loss in LOSSES.items())
    text = describe(summary(totals))
    assert "Final train loss 3.2143, validation loss 4.5459. Sent" in text and "outer step" not in text


def test_bytes_beyond_the_plan_are_explained_by_the_extra_micro_batches_that_sent_them():
    """Adaptive acco with FSDP inside computes micro-batches past --accum, each with FSDP's
    collectives: the summary's notes say why the counted bytes exceed the plan, and say nothing
    when the micro-batches were the planned ones."""
    from types import SimpleNamespace
    from lowcomm.metrics.summary import _notes
    cfg = SimpleNamespace(strategy="acco", steps=6, accum=1)  # plan: 6 steps x 2 halves + a start-up one
    totals = Totals(2)
    totals.wire, totals.micro_per_rank = 3_000_000, [18, 18]
    assert any("beyond the plan" in n and "18, 18" in n for n in _notes(cfg, "gloo", [], totals, 2_000_000))
    totals.micro_per_rank = [13, 13]
    assert not any("beyond the plan" in n for n in _notes(cfg, "gloo", [], totals, 2_000_000))
