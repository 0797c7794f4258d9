package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// roleNames are the roles a key or a user can have.
var roleNames = []string{"reader", "writer", "admin"}

func (a *app) whoamiCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "whoami",
		Short: "Show who the API takes the caller for",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			w, err := c.Whoami(cmd.Context())
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, w.JSON())
			}
			return fields(a.stdout, "kind", w.Kind, "id", w.ID, "name", w.Name, "org", w.Org, "org id", w.OrgID,
				"role", w.Role, "org roles", strings.Join(w.OrgRoles, ", "), "api", c.URL())
		},
	}
}

func (a *app) keysCommand() *cobra.Command {
	cmd := groupCommand(&cobra.Command{
		Use:   "keys",
		Short: "Make, list and revoke the org's API keys",
	})
	cmd.AddCommand(a.keysCreateCommand(), a.keysListCommand(), a.keysRevokeCommand())
	return cmd
}

func (a *app) keysCreateCommand() *cobra.Command {
	var (
		in        apiclient.KeyRequest
		expiresIn time.Duration
		expiresAt string
	)
	cmd := &cobra.Command{
		Use:   "create NAME --role ROLE",
		Short: "Make an API key; its secret is printed this once",
		Long: `Make an API key named NAME for a service of the org. Its secret, the
whole key to send as the bearer token, is printed alone on standard output
and is never shown again (only its SHA-256 is stored).`,
		Example: `  # for the billing service; not into your own CONVEYOR_TOKEN, which would
  # then win over CONVEYOR_KEY and leave this shell without the admin role
  BILLING_KEY=$(conveyor keys create billing --role writer --org-role finance --expires-in 720h)`,
		Args: exactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			in.Name = args[0]
			inGiven := cmd.Flags().Changed("expires-in")
			switch {
			case inGiven && expiresAt != "":
				return usagef("give --expires-in or --expires-at, not both")
			case inGiven && expiresIn <= 0:
				// 0 would send no expiry at all: a key that never expires.
				return usagef("--expires-in must be positive, got %s", expiresIn)
			case expiresIn > 0:
				in.ExpiresAt = new(a.now().Add(expiresIn).UTC())
			case expiresAt != "":
				t, err := time.Parse(time.RFC3339, expiresAt)
				if err != nil {
					return usagef("--expires-at %q is not an RFC 3339 time such as 2027-01-31T00:00:00Z", expiresAt)
				}
				in.ExpiresAt = &t
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			k, err := c.CreateKey(cmd.Context(), in)
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, k.JSON())
			}
			fmt.Fprintf(a.stderr, "made key %s (%s, role %s); its secret, below, is shown only this once\n", k.ID, k.Prefix, k.Role)
			_, err = fmt.Fprintln(a.stdout, k.Secret)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&in.Role, "role", "", "the key's role: reader, writer or admin")
	f.StringSliceVar(&in.OrgRoles, "org-role", nil, "org roles whose restricted tasks the key sees (repeat or comma-separate)")
	f.DurationVar(&expiresIn, "expires-in", 0, "the key expires after this long, such as 720h")
	f.StringVar(&expiresAt, "expires-at", "", "the key expires at this time (RFC 3339)")
	_ = cmd.MarkFlagRequired("role")
	_ = cmd.RegisterFlagCompletionFunc("role", fixedCompletions(roleNames...))
	return cmd
}

func (a *app) keysListCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the org's API keys, revoked ones included",
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			l, err := c.Keys(cmd.Context())
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, l.JSON())
			}
			now := a.now()
			t := newTable(a.stdout, "ID", "NAME", "ROLE", "PREFIX", "ORG ROLES", "CREATED", "LAST USED", "STATE")
			for _, k := range l.Keys {
				state := "active"
				switch {
				case k.RevokedAt != nil:
					state = "revoked " + stamp(*k.RevokedAt)
				case k.ExpiresAt != nil && !k.ExpiresAt.After(now):
					state = "expired " + stamp(*k.ExpiresAt)
				case k.ExpiresAt != nil:
					state = "expires " + stamp(*k.ExpiresAt)
				}
				t.row(k.ID, k.Name, k.Role, k.Prefix, strings.Join(k.OrgRoles, ","), stamp(k.CreatedAt),
					stampPtr(k.LastUsedAt), state)
			}
			return t.flush()
		},
	}
}

func (a *app) keysRevokeCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "revoke ID",
		Short: "Revoke an API key (every API instance refuses it within a second)",
		Args:  exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			k, err := c.RevokeKey(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, k.JSON())
			}
			// The name is the org's text: as in the table, an escape
			// sequence in it must not reach the terminal.
			_, err = fmt.Fprintf(a.stdout, "revoked key %s (%s, %s)\n", k.ID, oneLine(k.Name), k.Prefix)
			return err
		},
	}
}

func (a *app) usersCommand() *cobra.Command {
	cmd := groupCommand(&cobra.Command{
		Use:   "users",
		Short: "Add, list, change and remove the org's users (people)",
	})
	var in apiclient.UserRequest
	create := &cobra.Command{
		Use:   "create EXTERNAL_ID --role ROLE",
		Short: "Add a person, known by their identity provider's subject, and print their id",
		Args:  exactArgs(1, "EXTERNAL_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			in.ExternalID = args[0]
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			u, err := c.CreateUser(cmd.Context(), in)
			if err != nil {
				return err
			}
			return a.writeID(u.Document, u.ID)
		},
	}
	create.Flags().StringVar(&in.Email, "email", "", "the person's email")
	create.Flags().StringVar(&in.Role, "role", "", "the user's role: reader, writer or admin")
	_ = create.MarkFlagRequired("role")
	_ = create.RegisterFlagCompletionFunc("role", fixedCompletions(roleNames...))

	list := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the org's users",
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			l, err := c.Users(cmd.Context())
			if err != nil {
				return err
			}
			return a.writeUsers(l.Document, l.Users)
		},
	}

	var role string
	update := &cobra.Command{
		Use:   "update ID --role ROLE",
		Short: "Change a user's role",
		Args:  exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			u, err := c.SetUserRole(cmd.Context(), args[0], role)
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, u.JSON())
			}
			_, err = fmt.Fprintf(a.stdout, "user %s (%s) is now %s\n", u.ID, oneLine(u.ExternalID), u.Role)
			return err
		},
	}
	update.Flags().StringVar(&role, "role", "", "the user's new role: reader, writer or admin")
	_ = update.MarkFlagRequired("role")
	_ = update.RegisterFlagCompletionFunc("role", fixedCompletions(roleNames...))

	remove := &cobra.Command{
		Use:     "delete ID",
		Aliases: []string{"rm"},
		Short:   "Remove a user and their memberships",
		Args:    exactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			if err := c.DeleteUser(cmd.Context(), args[0]); err != nil {
				return err
			}
			return a.done("deleted user %s", args[0])
		},
	}
	cmd.AddCommand(create, list, update, remove)
	return cmd
}

func (a *app) rolesCommand() *cobra.Command {
	cmd := groupCommand(&cobra.Command{
		Use:   "roles",
		Short: "Define org roles, which tasks can be restricted to, and their members",
	})
	var name string
	create := &cobra.Command{
		Use:   "create SLUG",
		Short: "Define an org role",
		Args:  exactArgs(1, "SLUG"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			r, err := c.CreateRole(cmd.Context(), args[0], name)
			if err != nil {
				return err
			}
			return a.writeID(r.Document, r.Slug)
		},
	}
	create.Flags().StringVar(&name, "name", "", "display name (default: the slug)")

	list := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the org's roles",
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			l, err := c.Roles(cmd.Context())
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, l.JSON())
			}
			t := newTable(a.stdout, "SLUG", "NAME", "ID", "CREATED")
			for _, r := range l.Roles {
				t.row(r.Slug, r.Name, r.ID, stamp(r.CreatedAt))
			}
			return t.flush()
		},
	}

	remove := &cobra.Command{
		Use:     "delete SLUG",
		Aliases: []string{"rm"},
		Short:   "Remove an org role and its memberships",
		Args:    exactArgs(1, "SLUG"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			if err := c.DeleteRole(cmd.Context(), args[0]); err != nil {
				return err
			}
			return a.done("deleted role %s", args[0])
		},
	}

	members := &cobra.Command{
		Use:   "members SLUG",
		Short: "List a role's members",
		Args:  exactArgs(1, "SLUG"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			l, err := c.Members(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return a.writeUsers(l.Document, l.Members)
		},
	}

	membership := func(use, short string, member bool) *cobra.Command {
		return &cobra.Command{
			Use:   use + " SLUG USER_ID",
			Short: short,
			Args:  exactArgs(2, "SLUG and USER_ID"),
			RunE: func(cmd *cobra.Command, args []string) error {
				c, err := a.api(cmd)
				if err != nil {
					return err
				}
				if err := c.SetMember(cmd.Context(), args[0], args[1], member); err != nil {
					return err
				}
				if member {
					return a.done("user %s is a member of %s", args[1], args[0])
				}
				// The API answers alike whether or not the user was a
				// member: the removal is said, not claimed to have happened.
				return a.done("user %s is not a member of %s now", args[1], args[0])
			},
		}
	}
	cmd.AddCommand(create, list, remove, members,
		membership("add-member", "Make a user a member of a role", true),
		membership("remove-member", "End a user's membership of a role", false))
	return cmd
}

// groupCommand makes cmd, a command that only groups others, show its
// help when called alone and refuse a subcommand it does not have (a
// misspelt one) as the root does: a command used wrongly, not its help and
// exit 0, which cobra does for a command that cannot run itself.
func groupCommand(cmd *cobra.Command) *cobra.Command {
	cmd.Args = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return nil
		}
		msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
		if cmd.SuggestionsMinimumDistance <= 0 {
			cmd.SuggestionsMinimumDistance = 2 // as cobra sets for the root
		}
		if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
			msg += "\n\nDid you mean this?\n\t" + strings.Join(s, "\n\t") + "\n"
		}
		return usagef("%s", msg)
	}
	cmd.RunE = func(cmd *cobra.Command, _ []string) error { return cmd.Help() }
	return cmd
}

// writeUsers writes users as a table, or the API's document as JSON.
func (a *app) writeUsers(doc apiclient.Document, users []apiclient.User) error {
	if a.output == outputJSON {
		return writeJSON(a.stdout, doc.JSON())
	}
	t := newTable(a.stdout, "ID", "EXTERNAL ID", "EMAIL", "ROLE", "ORG ROLES", "CREATED")
	for _, u := range users {
		t.row(u.ID, u.ExternalID, u.Email, u.Role, strings.Join(u.OrgRoles, ","), stamp(u.CreatedAt))
	}
	return t.flush()
}

// writeID writes what was made: its id alone, for scripts, or the API's
// document as JSON.
func (a *app) writeID(doc apiclient.Document, id string) error {
	if a.output == outputJSON {
		return writeJSON(a.stdout, doc.JSON())
	}
	_, err := fmt.Fprintln(a.stdout, id)
	return err
}

// done reports an action that answers nothing: a line of text, or with
// -o json, nothing at all (the exit status says it worked).
func (a *app) done(format string, args ...any) error {
	if a.output == outputJSON {
		return nil
	}
	_, err := fmt.Fprintf(a.stdout, format+"\n", args...)
	return err
}
