"""The gradient path, from backward to the step: the reducer (hooks -> buckets -> reductions into
the units), the ``.grad`` links torch code sees, the per-pass flow, the global norm and clipping,
and what happens to parameters a pass did not touch."""
