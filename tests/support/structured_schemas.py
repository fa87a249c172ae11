"""JSON schemas for the structured-output tests: nested objects, arrays, enums, required fields, string patterns.

Strings and arrays are bounded so that a random-weight model finishes well within max_tokens."""

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
     "required": ["name", "age", "address"]},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
        "status": {"enum": ["ok", "error", "pending"]},
        "score": {"type": "number"}}, "required": ["tags", "status"]},
    {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[a-z]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}},
        "paid": {"type": "boolean"}}, "required": ["id", "items", "paid"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}},
            "required": ["email", "roles"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
]

# The same features, with short values: SmolLM2 on a CPU test machine generates ~50 tokens per record.
SMALL_SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"]}},
     "required": ["name", "address"]},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 2},
        "status": {"enum": ["ok", "error"]}}, "required": ["tags", "status"]},
    {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["qty"]}}},
     "required": ["id", "items"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"},
            "admin": {"type": "boolean"}}, "required": ["email", "admin"]}},
     "required": ["user"]},
]
