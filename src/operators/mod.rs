//! The built-in operators, one per module, each built from the core's structures.
