"""Front-ends: the `dcparallel` command line, the demo, `train`, `profile`."""
