"""`python -m dist_llm.train --config PATH [overrides]`: the entry torchrun runs on every rank."""

import sys

from dist_llm.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]], process_entry=True))
