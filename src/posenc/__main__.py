"""``python -m posenc ...`` runs the command line (same as the ``posenc`` script)."""

from posenc.cli.app import main

main()
