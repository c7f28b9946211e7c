"""``python -m fedps.cli``: the ``fedps`` command."""

from fedps.cli.app import main

main()
