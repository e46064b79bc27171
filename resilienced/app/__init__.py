"""The entry points and their assembly: ``cli`` (the ``resilienced`` command), ``daemon``
(``run``: settings -> runtime -> consumer loop, HTTP server), ``runtime`` (which adapter serves
which port in each mode), and the commands ``replay``, ``status`` and ``inject``.  A face: it
imports nothing."""
