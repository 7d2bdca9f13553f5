# The one image every service of docker-compose.yml runs: web (uvicorn), scheduler, event
# consumer and host agents. Its install step is the one `./edt up` runs on a bare machine.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Training processes run as this user, never as root (an agent started as root with
# EDT_RUN_AS_UID_BASE runs each user's jobs under an account of their own); the folders below
# are the mount points of the shared volumes, created here so that new named volumes take this
# owner.
RUN useradd --create-home --uid 1000 edt \
    && mkdir -p /srv/edt/data /srv/edt/models /srv/edt/results /srv/edt/var /app \
    && chown -R edt:edt /srv/edt /app

WORKDIR /app
COPY --chown=edt:edt . /app

# The same install step as `./edt` (there it is editable, here the code is baked in). torch is
# pinned by pyproject.toml (torch==2.13.0) and taken from whatever index pip is configured with:
# PyPI's default, whose Linux wheel also carries the CUDA libraries the gpu-worker needs. To
# build a smaller CPU-only image, pass --build-arg PIP_EXTRA_INDEX_URL=<a CPU wheel index>.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
RUN python -m pip install --upgrade pip \
    && python -m pip install .

# Static files are collected at build time and served by whitenoise from the web process. The
# throwaway key keeps settings from writing a real one into the image.
ENV STATIC_ROOT=/app/staticfiles \
    EDT_VAR_DIR=/srv/edt/var
RUN SECRET_KEY=collectstatic-only DEBUG=false python manage.py collectstatic --noinput \
    && chown -R edt:edt /app/staticfiles

USER edt
EXPOSE 8000
# http only; docker-compose's web service runs `manage.py serve_web` for https on 8443 too. The
# web server bounds request bodies (EDT_MAX_REQUEST_BYTES, EDT_MAX_UPLOAD_BYTES on upload
# views) before it reads them: config/body_limit.py.
CMD ["python", "-m", "config.web_server", "--host", "0.0.0.0", "--port", "8000"]
