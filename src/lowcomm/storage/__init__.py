"""A run's files written whole, when the disk may be full (files.py): a small file written to a
temporary name and renamed, a directory put in place in one step (a final model, a prepared data
set), a full disk turned into one line naming the path, what an interrupted write left removed,
and whether a path can be written at all. Checkpoints, run logs, traces, run directories, saved
models and prepared data sets are all written through it.

Imports: errors.
"""
