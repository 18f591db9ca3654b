"""kvplay."""
