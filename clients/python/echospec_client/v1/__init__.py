"""gRPC stubs of echospec.v1 (common, coordinator), generated at build time from protos/ by
scripts/gen_protos.py (generate_client); never edited by hand."""
