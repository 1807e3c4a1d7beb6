"""The pack against plain Lightning and the raw loop, part by part: ``bench account`` (``run``, its tables in
``report``) and its one-device MNIST view, ``bench overhead`` (``overhead``)."""
