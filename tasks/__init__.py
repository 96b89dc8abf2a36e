"""One thin module per pipeline stage: read params, call the library, write outputs atomically."""
