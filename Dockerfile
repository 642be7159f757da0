# afstream, built from this repository.
# The toolchain the project is built and tested with.
FROM rust:1.95-bookworm AS build
RUN apt-get update -qq && apt-get install -y -qq clang libclang-dev cmake >/dev/null
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin afstream

FROM debian:bookworm-slim
RUN apt-get update -qq && apt-get install -y -qq ca-certificates >/dev/null && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/afstream /usr/local/bin/afstream
COPY configs /configs
# Relative state_dir paths (the configs' `afstream-state`) land here; mount a
# volume on it so that local stores survive the container.
WORKDIR /var/lib/afstream
ENTRYPOINT ["afstream"]
