"""Runtime: the device mesh, processes of a run, the compilation cache, host and device memory."""
