"""nanogeo: the production path of GeoFP8 (tools and integrations).

The algorithm itself lives in the top-level `compress.py`; everything here imports it."""
