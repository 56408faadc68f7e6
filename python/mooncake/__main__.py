"""``python -m mooncake ARGS...``: the bundled mooncake binary."""

from .cli import main

main()
