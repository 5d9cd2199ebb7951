"""Generated from protos/hetero_pd/v1; do not edit."""
