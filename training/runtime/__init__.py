"""Runtime: the device mesh, processes of a run, the compilation cache and host memory."""
