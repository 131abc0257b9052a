"""The package logger: one 'deepspeed_cpp' logger that prints to stderr unless configured."""

import logging

logger = logging.getLogger("deepspeed_cpp")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
