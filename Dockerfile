# One image for every Conveyor binary (api, relay, worker in /usr/local/bin).
# The image has no ENTRYPOINT: the command names the binary, found on PATH,
# and defaults to the API.
#   docker run IMAGE                      the API
#   docker run IMAGE api migrate          apply the migrations and exit
#   docker run IMAGE relay                the relay
#   docker run IMAGE worker               the worker
# docker-compose.yml (entrypoint:) and deployments/kubernetes (command:) name
# the binary by its absolute path instead, which amounts to the same.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath \
      -ldflags "-s -w -X github.com/conveyorhq/conveyor/internal/telemetry.Version=${VERSION} -X main.version=${VERSION}" \
      -o /out/ ./cmd/...

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
# distroless sets this PATH already; spelled out because the commands above
# rely on it.
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# distroless's nonroot user, by number: Kubernetes' runAsNonRoot (as in
# deployments/kubernetes) cannot check a user given by name and refuses to
# start the container ("image has non-numeric user").
USER 65532:65532
CMD ["api"]
