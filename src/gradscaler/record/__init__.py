"""The run's record: what a scaler counts and logs while it trains, and reading that log back afterwards.

The package, lowest first; a file imports only files above it in this list (tests/test_layers.py):

- ``logfile``: what a log file and the figure's path say before a line is read (a missing, empty
  or folder log; the figure's file), answered without torch; the counters' names.
- ``telemetry``: the counters and the bounded history of the scale, kept where the scale lives
  (``Telemetry`` on a device, ``HostTelemetry`` on the CPU), read without blocking.
- ``logsummary``: ``LogSummary``, what a scaler log adds up to (of bounded size), and the fold that
  adds one checked record to it.
- ``monitor``: what to tell the user about the counters: ``Monitor`` (loggers, parameter names, attribution of
  non-finite gradients, collapse detection, the log record of docs/log-format.md), fed values by its
  scaler; the loggers ``JsonLinesLogger`` and ``TensorBoardLogger``.
- ``scalerlog``: a log file read in one streaming pass and every record checked (``summarise``,
  ``LogError``).
- ``diagnosis``: the report's rules as pure functions of a ``LogSummary``, and its text.
- ``reporting``: ``report(path, out)``, the text and the figure (matplotlib, imported when drawing).

Nothing here sees a ``GradScaler``: the scaler feeds ``telemetry`` and ``monitor`` values, and the
other five read a file, without torch (``gradscaler report`` never imports it). Public names
(``JsonLinesLogger``, ``TensorBoardLogger``, ``report``) are ``gradscaler``'s; this ``__init__`` imports
nothing, so reading a log loads only what it needs.
"""
