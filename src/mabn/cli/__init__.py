"""The command line: the LightningCLI with the project's checks (``lightning``), the stage launch that plans a run
(``launch``), the parsers' shared help (``help``) and the commands of stages and checkpoints (``commands``)."""
