# syntax=docker/dockerfile:1
#
# docker build -t proxy-operator:dev .
#
# Build stage: the toolchain the crate pins (rust-version 1.95), the exact dependency versions
# of Cargo.lock. The cache mounts keep downloaded crates and compiled dependencies between
# builds.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin proxy-operator \
    && install -D target/release/proxy-operator /out/proxy-operator

# Runtime stage: glibc, CA certificates (for https:// probe URLs) and nothing else; no shell.
# Runs as uid 65532 ("nonroot"), the uid the Deployment asks for.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/proxy-operator /usr/local/bin/proxy-operator
USER 65532:65532
EXPOSE 8090 8080 8888
ENTRYPOINT ["/usr/local/bin/proxy-operator"]
CMD ["--help"]
