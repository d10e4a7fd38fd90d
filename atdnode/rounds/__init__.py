"""Serverless training rounds (`atd rounds`): the runner, the round rules and its fabric."""
