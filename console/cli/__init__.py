"""Command-line clients. Nothing here may import Django: they run on laptops without it."""
