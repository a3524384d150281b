"""Reviewing a change: what it does to the fleet (`pdctl diff`). Pure functions over two
offline runs of the same program; the CLI renders the report as text, Markdown or JSON."""
