"""The front doors: their shared lifecycle, the Trainer's and Fabric's strategies, names, the profiler."""
