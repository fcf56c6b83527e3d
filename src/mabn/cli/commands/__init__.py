"""The commands of ``python -m mabn <command>`` that run a stage or a checkpoint, one module each
(``mabn.__main__`` dispatches); their parsers' shared parts are in ``mabn.cli.help``."""
