"""Quantisation formats shared by the layers."""
