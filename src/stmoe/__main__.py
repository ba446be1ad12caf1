"""``python -m stmoe`` runs the command line."""

from stmoe.cli import main

main()
