"""From an epoch's plan to batches: the plan, the window map, the reader, the pipeline's threads and the
assembler, position and resume."""
