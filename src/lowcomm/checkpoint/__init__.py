"""Checkpoints: written with torch.distributed.checkpoint (DCP), made atomic, verified before use.

A checkpoint is a directory `ckpt-NNNNNN` (the trainer step it was taken after) in the
run's output directory:

    ckpt-000400/
      __0_0.distcp, __1_0.distcp, ...   DCP's data files, one per rank
      .metadata                          DCP's index of every entry
      config.toml                        the resolved config of the run
      manifest.json                      step, strategy, world size, config hash, sha256 of every file
      model/                             the evaluated model as a run's final one (OUT/model/): for
                                         --init-from and `lowcomm sample`; not read by a resume

One module a job: layout.py (names, manifest checksums, the config hash), state.py (the
trainer's state as DCP stores it, and loading it back), write.py (requests and the atomic
write), choose.py (verifying one, choosing the newest usable one), recut.py (a checkpoint of
another number of workers re-cut for this one: a plain and an elastic resume alike), resume.py
(`--resume` and relaunches after a failure). The names below are the package's interface.
Imports: config, contract, storage (files written whole, a full disk), errors.
"""
from .choose import Found, WorldSizeError, check_world, latest, read, verify
from .layout import FORMAT, MANIFEST, PREFIX, SAFE_KEYS, config_hash, listed, name_of, prune
from .resume import prepare_resume, restart_from, resume_config
from .state import _Ref, load, read_state  # noqa: F401  (_Ref: the name skeletons pickle)
from .write import request, save, take_request

__all__ = ["FORMAT", "MANIFEST", "PREFIX", "SAFE_KEYS", "Found", "WorldSizeError", "check_world",
           "config_hash", "latest", "listed", "load", "name_of", "prepare_resume", "prune", "read",
           "read_state", "request", "restart_from", "resume_config", "save", "take_request", "verify"]
