"""The pack against plain Lightning and the raw loop, part by part: ``benchmarks account`` (``run``, its tables in
``report``) and its one-device MNIST view, ``benchmarks overhead`` (``overhead``)."""
