"""The jobs (`forward`, `generate`, `demo`) and the command line that runs them."""
