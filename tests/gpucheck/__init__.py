"""``make gpu-check`` (``python -m tests.gpucheck``): the GPU slot's one command. It runs this checkout's GPU test
tier and the pack's own code from source, so it lives with the tests, outside the installed package: the wheel
ships only what works from the wheel."""
