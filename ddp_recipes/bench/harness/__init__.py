"""The measured runs every comparison shares: each in fresh processes (``worker``: pack and plain Lightning;
``baselines``: the raw, write-up and DataParallel loops) on one workload (``workload``, ``synthetic``), timed
one way (``measure.StepEnds``; ``components`` drives it from a Lightning callback)."""
