"""Drawings of the course's data structures (matplotlib), one module per picture."""
