"""Pre-built op libraries (setup.py with DS_BUILD_OPS=1 or DS_BUILD_<OP>=1) land here."""
