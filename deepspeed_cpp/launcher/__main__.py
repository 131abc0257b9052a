"""``python -m deepspeed_cpp.launcher [flags] script.py [script args]``."""

from .runner import main

if __name__ == "__main__":
    main()
