"""The wire protocol: the ``.proto`` sources and the code generated from them (``generate.sh``)."""
